"""The request path: admission, request models, preparation, chat templating, tools,
grammars, reasoning, the tokenizer and the generation object.
"""
