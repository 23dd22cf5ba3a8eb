"""vLLM, in one place (`engine.name=vllm`, GPU only): the import with its install hint, the
engine arguments and the context length (setup.py), the sampler engine (engine.py), merged
weight versions sent over CUDA IPC (merged.py), and a row's next request rendered from its last
one (render.py). Training and evaluation open it through `workbench.engines`; the endpoint's
vLLM replica (`serve.vllm_async`) builds its async engine from the same arguments. The vllm
package itself is imported only when an engine opens."""
