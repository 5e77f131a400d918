"""placeholder"""
class Voc2007: pass
