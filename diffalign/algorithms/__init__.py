"""Algorithms as pure tensor functions: advantage estimators and losses, testable without a model."""
