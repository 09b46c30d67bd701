"""The fast paths behind the chapter's seams: attention backends, and the fused and compiled flat models.

``engine/serve/registry.py`` finds each by name — attention: ``torch_attention`` (vectorized, the
default), ``cpu_attention`` (a C++ kernel that reads the pool in place), ``triton_attention``
(chapter 32, GPU); flat models: ``fused`` (``flat_model="fused"``, with ``cpu_linear``'s
small-batch kernel on a CPU) and ``compiled`` (``flat_model="compiled"``). Each is tested against
the chapter's ``ReferenceBackend`` / ``FlatModel``; the chapter's files import none of them.
"""
