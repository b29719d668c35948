"""Tests of service/http."""
