"""The floor every process stands on: configuration Structs, heap settling, profiling hooks
and the worker's link to the orchestrator. It imports no process package (orchestrator,
gateway, llm_worker, codec_worker); the wire contract below it is ``shm``."""
