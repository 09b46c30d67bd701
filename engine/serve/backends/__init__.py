"""The fast paths behind the chapter's seams: attention backends, and the fused and compiled flat models.

``get_backend(name)`` (in ``engine/serve/attention.py``) imports a backend from here by name:
``torch_attention`` (vectorized, the default), ``cpu_attention`` (a C++ kernel that reads the pool
in place), ``triton_attention`` (chapter 32, GPU). ``fused`` is ``EngineConfig(fuse_ops=True)``'s
model (with ``cpu_linear``'s small-batch kernel on a CPU) and ``compiled`` is ``compile=True``'s.
Each is tested against the chapter's ``ReferenceBackend`` / ``FlatModel``.
"""
