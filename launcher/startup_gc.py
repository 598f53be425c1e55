"""The garbage collector around a process's start-up imports: off while they run, then their objects set aside.

CPython runs a full collection each time the objects alive grow by a quarter, and each one scans every object
imported so far: while torch (and the dynamo that DDP's constructor imports) import, that is five full
collections, 0.7 s of each worker's start here, which free a few hundred objects. Frozen afterwards, the
imported modules' objects are in no later collection (dist.shutdown's full one took 0.3 s with dynamo in
memory); what the run itself makes is collected as before.
"""
import gc


def imports_begin() -> None:
    """Before the imports of seconds (torch's): no collection while they run."""
    gc.disable()


def imports_done() -> None:
    """After them: what they made moves to the permanent generation, then collections resume."""
    gc.freeze()
    gc.enable()
