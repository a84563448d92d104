"""Training, evaluation and export of the acceptance predictor (`dscale-train`)."""
