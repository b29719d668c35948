"""Tests of training/references."""
