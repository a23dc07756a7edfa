"""Command-line tools: the demo (python -m hypershard.demo), the layout demo, the operator
coverage of a model on a mesh (python -m hypershard.coverage) and the generated operator
reference (operators_doc). They use the public API and hypershard.testing's tiny models."""
