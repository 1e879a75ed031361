"""Serving glue between Triton models and the engine library."""
