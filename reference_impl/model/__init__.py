"""DeepSeek-V3-structured model pieces; `chunk.StageChunk` assembles one pipeline stage."""
