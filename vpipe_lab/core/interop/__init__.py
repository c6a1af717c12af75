"""The lab's plans in other tools' words, and back: torch.distributed.pipelining's schedule actions and classes, the
export bundle's ``pipeline.json``, torchtitan's ``[parallelism]`` settings and Megatron-LM's pipeline layout string
(standard library only; writing the files is ``wire/bundle_files.py``, running a bundle on torch is
``runtime/torch_pp/pipeline.py``)."""
