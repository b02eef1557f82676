"""llama.cpp branches, split where the processes are: the gateway side
(:mod:`.engine`: the engine, its generations and its supervised worker), the worker
process (:mod:`.worker` and what only it imports: tokenizer, prompt cache, sampler
chain, constrained decoding, scoring) and the build probe (:mod:`.build`)."""
