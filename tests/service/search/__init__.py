"""Tests of service/search."""
