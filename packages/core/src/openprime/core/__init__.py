"""openprime.core: configs, the Transport and Codec interfaces, wire frames and collectives.

Every other openprime package depends on this one and on nothing else of openprime (DESIGN.md).
"""
