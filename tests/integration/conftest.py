"""Fixtures for the local-backend integration tests: real processes, gRPC and TensorFlow.

The prepared data sets (digits_data, ctr_data) are in tests/conftest.py: the parity tests use them too."""
