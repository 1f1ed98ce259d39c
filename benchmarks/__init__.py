"""The benchmarks of jax-gdn: one CLI with named sections (``python -m benchmarks --help``), run from the
repository root; not part of the installed package.

Modules: ``__main__`` (the CLI), ``sections`` (the names and what each writes), ``cases`` (every named shape),
``results`` (the results JSON: paths, merging, stamps), ``tables`` (formatting and the floors' peak rates),
``timing`` (the torch side of ``jax_gdn.timing`` and the whole-model timings), ``peers`` (FLA, jax-linear-attention
and torch runners), ``hf`` (HF transformers' Qwen3-Next on FLA's kernels), one module per section (``gdn``,
``decode``, ``attention``, ``moe``, ``layers``, ``model`` with ``model_parts`` and ``floors``, ``sharding``).
"""
