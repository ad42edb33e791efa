"""The container format: numpy only (no JAX, no torch).

`spec` (block size, codec registry), `reader` (parse, verify, decode), `container`
(atomic writer), `packed` (logrel-aw bit packing) and `storage` (local paths and fsspec
URLs).  Nothing here imports `jaxguard.core` or an adapter."""
