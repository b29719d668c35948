"""Tests of service/engine."""
