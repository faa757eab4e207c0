"""BlueCache from Python: objects on the node's DPU, moved by DMA between a
registered buffer and the DPU's storage (see docs/bluecache.md).

    from dpumesh.store import StoreClient

    store = StoreClient(os.environ["DPUMESH_CONTROL"])
    store.put("models/a", data)             # one buffer, one PUSH
    data = store.get("models/a")            # bytes, or None

    buf = store.register(1 << 20)           # batches, asynchronous
    buf.write(0, data)
    transfer = store.put_batch([("a", buf, 0, len(data))])
    while not transfer.done(): ...
    [result] = transfer.wait()              # {"status": "Ok", "size": .., "crc32": ..}
"""

from ._native import StoreBuffer, StoreClient, Transfer

__all__ = ["StoreBuffer", "StoreClient", "Transfer"]
