"""llama.cpp branches, split where the processes are.

* the gateway side: :mod:`.engine` (``LlamaCppEngine``: its supervised worker and the
  pipe's reader), :mod:`.generation` (a generation's events, a push source),
  :mod:`.options` (``WorkerOptions``: the worker's argv and environment),
  :mod:`.model_file` (the verified file a worker loads), :mod:`.exchange_timer`;
* both sides: :mod:`.wire`, every message between the gateway and a worker;
* the worker process (``python -m quantroute.engines.llamacpp.worker``): :mod:`.worker`
  (argv, command reader, loop) and what only it imports: ``worker_model``,
  ``worker_admission``, ``worker_batch``, ``worker_sequence``, ``worker_output``,
  ``tokenizer``, ``prompt_cache``, ``sampler_chain``, ``constrained``, ``scoring``;
* the build probe: :mod:`.build`.
"""
