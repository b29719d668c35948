"""Tests of training/evaluation."""
