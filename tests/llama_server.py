"""llama-cpp-python's OpenAI server (``python -m llama_cpp.server``, same arguments), with the weight-repacking rule
of ``engine.extra_buffer_types = "auto"``: no extra buffer types on an AMX CPU, where llama.cpp's AMX matmul faults on
the first decode. llama-cpp-python's server has no option for it; tests/test_engine_openai_upstream.py runs this
script in its own process as the real upstream, so the rule applies there alone.
"""

from __future__ import annotations

from typing import Any

import llama_cpp

from edgecache.cpu import cpu_flags, extra_buffer_types_on
from edgecache.engines.llamacpp import llama_class



class Llama(llama_class(llama_cpp)):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, use_extra_bufts=extra_buffer_types_on("auto", cpu_flags()), **kwargs)


llama_cpp.Llama = Llama  # the server builds its model through this name, at load time

if __name__ == "__main__":
    from llama_cpp.server.__main__ import main

    main()
