"""Tests of service/ops."""
