"""Tests of training/optim."""
