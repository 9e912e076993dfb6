"""What a client sends, checked: the body, OpenAI's request fields, prompts as token ids, the tokenizer."""
