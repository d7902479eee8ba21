/* Helpers the generated predicate kernels share; the generated kernel is appended to this source
   (src/datafusion/predicate_codegen.rs). */
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ bool bit(const unsigned char* b, u64 i) { return (b[i >> 3] >> (i & 7)) & 1; }
__device__ __forceinline__ bool valid(const unsigned char* b, u64 i) { return b == 0 || bit(b, i); }
/* Keys in arrow's total order of floats, after -0.0 becomes +0.0 as in DataFusion's comparisons. */
__device__ __forceinline__ long long fkey32(float x) {
    if (x == 0.0f) x = 0.0f;
    int b = __float_as_int(x);
    b ^= (int)(((unsigned int)(b >> 31)) >> 1);
    return (long long)b;
}
__device__ __forceinline__ long long fkey64(double x) {
    if (x == 0.0) x = 0.0;
    long long b = __double_as_longlong(x);
    b ^= (long long)(((u64)(b >> 63)) >> 1);
    return b;
}
/* -1, 0 or 1 for two little-endian 128-bit signed integers. */
__device__ __forceinline__ int cmp128(const unsigned char* a, const unsigned char* b) {
    long long ah = *(const long long*)(a + 8), bh = *(const long long*)(b + 8);
    if (ah != bh) return ah < bh ? -1 : 1;
    u64 al = *(const u64*)a, bl = *(const u64*)b;
    return al == bl ? 0 : (al < bl ? -1 : 1);
}
__device__ __forceinline__ bool bytes_eq(const unsigned char* a, const unsigned char* b, u64 n) {
    for (u64 k = 0; k < n; k++) if (a[k] != b[k]) return false;
    return true;
}
__device__ __forceinline__ bool str_eq(const unsigned char* p, u64 n, const unsigned char* lit, u64 slot) {
    u32 o = *(const u32*)(lit + slot), l = *(const u32*)(lit + slot + 4);
    return n == l && bytes_eq(p, lit + o, n);
}
__device__ __forceinline__ bool str_prefix(const unsigned char* p, u64 n, const unsigned char* lit, u64 slot) {
    u32 o = *(const u32*)(lit + slot), l = *(const u32*)(lit + slot + 4);
    return n >= l && bytes_eq(p, lit + o, l);
}
/* SQL LIKE with % (any characters) and _ (one UTF-8 character), no escapes. */
__device__ __forceinline__ u64 utf8_next(const unsigned char* s, u64 i, u64 n) {
    i++;
    while (i < n && (s[i] & 0xC0) == 0x80) i++;
    return i;
}
__device__ bool like_match(const unsigned char* s, u64 n, const unsigned char* p, u64 m) {
    u64 i = 0, j = 0, star_j = (u64)-1, star_i = 0;
    while (i < n) {
        if (j < m && p[j] == '_') { i = utf8_next(s, i, n); j++; }
        else if (j < m && p[j] == '%') { star_j = j++; star_i = i; }
        else if (j < m && p[j] == s[i]) { i++; j++; }
        else if (star_j != (u64)-1) { j = star_j + 1; star_i = utf8_next(s, star_i, n); i = star_i; }
        else return false;
    }
    while (j < m && p[j] == '%') j++;
    return j == m;
}
__device__ __forceinline__ bool str_like(const unsigned char* p, u64 n, const unsigned char* lit, u64 slot) {
    u32 o = *(const u32*)(lit + slot), l = *(const u32*)(lit + slot + 4);
    return like_match(p, n, lit + o, l);
}
