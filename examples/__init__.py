"""The example notebooks (run by nbval). A package, so that pytest imports its conftest as
examples.conftest and the test modules' `from conftest import ...` still find tests/conftest.py."""
