from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache
from hcache.model.loader import LoadedModel, load

__all__ = ["DecoderModel", "KVCache", "LoadedModel", "load"]
