"""Tests of training/distributed."""
