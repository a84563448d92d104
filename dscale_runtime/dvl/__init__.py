"""DVL: acceptance features, the acceptance predictor, Algorithm 1 budget allocation and flat-pack."""
