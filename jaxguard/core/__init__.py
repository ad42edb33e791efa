"""The JAX core: op models, codes, the bound and its closed-form tier, the guard.

Imports `jaxguard.format` and `jaxguard.errors`, never an adapter (optax, orbax, torch,
CLI)."""
