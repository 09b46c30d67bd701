"""Chapter 31's engine core (and chapter 24's slot engine for comparison).

Import path for everything the chapter names::

    from engine.serve import EngineCore, EngineConfig, SamplingParams, Request, BlockManager, \\
        Scheduler, hash_block, build_batch
"""
from engine import _impl
from engine.serve.attention import ReferenceBackend, write_kv
from engine.serve.batch import Batch, BatchMeta, build_batch
from engine.serve.blocks import BlockManager, hash_block
from engine.serve.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.serve.engine import EngineCore, RequestOutput
from engine.serve.flat import FlatModel, add_norm
from engine.serve.params import SamplingParams
from engine.serve.request import Request, Status
from engine.serve.registry import get_backend, get_flat_model
from engine.serve.runner import ModelRunner
from engine.serve.sampler import SimpleSampler
from engine.serve.scheduler import Scheduler, SchedulerOutput
from engine.serve.sizing import kv_bytes_per_block, num_blocks_for_memory, profile_num_blocks

__all__ = [
    "Batch", "BatchMeta", "BlockManager", "CacheConfig", "EngineConfig", "EngineCore", "FlatModel", "ModelRunner",
    "ReferenceBackend", "Request", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SimpleSampler", "Status", "add_norm", "build_batch", "get_backend", "get_flat_model", "hash_block",
    "kv_bytes_per_block", "num_blocks_for_memory", "profile_num_blocks", "write_kv",
]

_impl.apply_at_import()  # ENGINE_IMPL=solution: the reference answers in the holes
