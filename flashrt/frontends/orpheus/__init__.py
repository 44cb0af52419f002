"""The Orpheus family (an LM emitting SNAC 24 kHz codes): `layout` (token layout, prompt, speakers,
tokens -> SNAC frames), `folder` (recognising a model folder, its SNAC decoder and checked layout),
`tts` (`OrpheusTTS`: the LM's slot decoder and the SNAC decoder as one chain).

Loading (`flashrt.load_tts`, `flashrt.runner.orpheus.load_orpheus`) sits with the runners: the SNAC
decoder is the vocoder runner's.
"""
