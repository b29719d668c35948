"""Tests of training/model."""
