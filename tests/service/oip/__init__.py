"""Tests of service/oip."""
