"""Data: the stdlib code corpus (tfds/array_record), tokenizers, packed grain batches."""
