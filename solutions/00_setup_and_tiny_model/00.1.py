# EXERCISE 00.1
vocab = tokenizer.get_vocab()
ids_by_hand = [vocab["<bos>"]] + [vocab[c] for c in "12+34="]
