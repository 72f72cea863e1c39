"""Numerical kernels: readable references and the fast paths beside them."""
