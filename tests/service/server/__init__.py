"""Tests of service/server."""
