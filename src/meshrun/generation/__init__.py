"""Using a trained model to generate: sampling text (`sample`) and encoder-decoder search (`seq2seq`)."""
