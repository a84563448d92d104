"""Trace collection: run full-width DFlash over prompt sets and log per request-step features and labels."""
