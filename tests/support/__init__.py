"""Helpers the tests import (one way: tests -> tests.support, never test -> test)."""
