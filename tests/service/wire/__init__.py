"""Tests of service/wire."""
