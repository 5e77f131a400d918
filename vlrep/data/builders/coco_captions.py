"""placeholder"""
class CocoCaptions2017: pass
