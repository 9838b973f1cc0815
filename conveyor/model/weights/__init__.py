"""Reading weights: finding a model (a folder, a GGUF file, a packaged name), its config and tokenizer, and its
tensors under Conveyor's names, kept in the file's quantized formats where the native kernels run them."""
