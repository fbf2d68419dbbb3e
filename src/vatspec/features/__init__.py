"""The offline target-feature cache: the frozen target run once, its layer outputs stored on disk.

    format.py    file names, the manifest and its checks, hashes (docs/features.md specifies the format)
    writer.py    write_cache: batched, sharded, resumable; finalize_cache
    reader.py    FeatureCache (checked reads), CachedTarget (a Target whose forward reads the cache)
    validate.py  validate_cache: re-read everything, compare a sample with a fresh target forward

``vatspec cache-features`` writes and validates a cache; ``vatspec train data.features=DIR`` trains
from one with no target forward but the lm_head for soft labels.
"""

from vatspec.features.format import (
    FORMAT,
    FORMAT_VERSION,
    STORAGE_DTYPES,
    FeatureCacheError,
    bytes_per_token,
    config_layer_ids,
    drafter_layer_ids,
    token_hash,
)
from vatspec.features.reader import CachedTarget, FeatureCache
from vatspec.features.writer import finalize_cache, plan_shards, write_cache

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "STORAGE_DTYPES",
    "CachedTarget",
    "FeatureCache",
    "FeatureCacheError",
    "bytes_per_token",
    "config_layer_ids",
    "drafter_layer_ids",
    "finalize_cache",
    "plan_shards",
    "token_hash",
    "write_cache",
]
