"""The rank-local worker: the model, its KV pool, the attention backend, the CUDA graphs
and sampling on one device, fed one ``StepInput`` (plain arrays) per step."""
