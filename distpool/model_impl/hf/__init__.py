"""The transformers runner: Hugging Face's own modeling code of hybrid architectures, its KV in our
pages and its recurrent state in our slots.

`support` and `source` say what it runs and where the weights come from without importing
transformers (so `check`, `presets` and the reference model never pay for it), and `tokenizer`
imports it only for a folder that holds a tokenizer; `loader`, `layout`, `paged_attention`,
`state_cache`, `runner` and `oracle` import it. What they use beyond transformers' documented API
(its cache layers' internals, private functions) is in `transformers_internals`, which refuses a
transformers release it was not checked against when it is imported.
"""
