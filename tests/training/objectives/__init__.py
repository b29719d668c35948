"""Tests of training/objectives."""
