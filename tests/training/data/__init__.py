"""Tests of training/data."""
