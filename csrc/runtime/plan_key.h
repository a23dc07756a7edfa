// The plan-cache key: one encoding of a call's arguments, written by the boxed flow (from the
// IValue stack) and by the typed fast path (from typed arguments), word for word the same.
//
// Why it cannot collide: every argument is one self-delimiting chunk -- a tag word naming the
// value's kind, then a payload whose length the tag (or, for lists and strings, a length word
// after it) fixes. For one operator (the caches are per operator, so the schema is fixed), the
// chunks of a key therefore parse back into exactly one sequence of (kind, value) pairs: two calls
// that differ in any keyed argument -- None against an int, -7 against None, a negative against a
// positive dim, an int against a float or a bool, [1, 2] against [[1], [2]], one dtype against
// another, an absent optional tensor against a present one -- differ in some word. Tensors are
// keyed by their interned layout (pointer identity is content identity: interned layouts live
// for the process) or, for plain tensors, by dtype and shape. Values no rule can read are keyed
// by kind only (a Generator).
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <cstring>
#include <string_view>

#include "layout/layout.h"

namespace hypershard::runtime {

enum class KeyTag : int64_t {
  kNone = 1,         // no payload
  kInt,              // value
  kBool,             // value
  kDouble,           // bit pattern
  kComplex,          // real and imaginary bit patterns
  kString,           // byte count, then the bytes packed 8 per word
  kDevice,           // device type, index
  kList,             // element count, then each element's chunk
  kDTensor,          // interned layout address, dtype
  kPlainTensor,      // dtype, dim, sizes
  kUndefinedTensor,  // no payload
  kOpaque,           // the kind's name as a string payload (values no rule reads)
  kBackward,         // whether the call runs inside a backward pass
};

class PlanKey {
 public:
  using Words = c10::SmallVector<int64_t, 24>;  // on the stack: no heap allocation per call

  void none() { tag(KeyTag::kNone); }
  void integer(int64_t v) { chunk(KeyTag::kInt, v); }
  void boolean(bool v) { chunk(KeyTag::kBool, v); }
  void real(double v) { chunk(KeyTag::kDouble, bits(v)); }
  void complex(c10::complex<double> v) { chunk(KeyTag::kComplex, bits(v.real()), bits(v.imag())); }
  void string(std::string_view s) {
    tag(KeyTag::kString);
    words_.push_back(static_cast<int64_t>(s.size()));
    for (size_t i = 0; i < s.size(); i += 8) {
      int64_t word = 0;
      std::memcpy(&word, s.data() + i, std::min<size_t>(8, s.size() - i));
      words_.push_back(word);
    }
  }
  void device(c10::Device d) { chunk(KeyTag::kDevice, static_cast<int64_t>(d.type()), d.index()); }
  // A list of `count` elements; the caller appends each element's chunk next.
  void list(size_t count) { chunk(KeyTag::kList, static_cast<int64_t>(count)); }
  void dtensor(const layout::Layout* layout, c10::ScalarType dtype) {
    chunk(KeyTag::kDTensor, reinterpret_cast<int64_t>(layout), static_cast<int64_t>(dtype));
  }
  void plain_tensor(c10::ScalarType dtype, c10::IntArrayRef sizes) {
    tag(KeyTag::kPlainTensor);
    words_.push_back(static_cast<int64_t>(dtype));
    words_.push_back(static_cast<int64_t>(sizes.size()));
    for (int64_t s : sizes) words_.push_back(s);
  }
  void undefined_tensor() { tag(KeyTag::kUndefinedTensor); }
  void opaque(std::string_view kind) {
    tag(KeyTag::kOpaque);
    string(kind);
  }
  void in_backward(bool v) { chunk(KeyTag::kBackward, v); }

  // One argument from the boxed stack: a tensor (list) always, a non-tensor value when
  // `key_scalars` (the rule reads scalar arguments). `tensor_typed`: the schema declares a
  // tensor there (so None is an absent optional tensor and is keyed as such).
  void argument(const c10::IValue& v, bool tensor_typed, bool key_scalars);

  uint64_t hash() const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : words_) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return h;
  }
  const Words& words() const { return words_; }
  bool operator==(const PlanKey& other) const { return words_ == other.words_; }
  bool operator!=(const PlanKey& other) const { return !(*this == other); }

 private:
  void tag(KeyTag t) { words_.push_back(static_cast<int64_t>(t)); }
  // A tag and its fixed payload in one append (one capacity check: the key is written per call).
  template <typename... Payload>
  void chunk(KeyTag t, Payload... payload) {
    words_.append({static_cast<int64_t>(t), static_cast<int64_t>(payload)...});
  }
  static int64_t bits(double v) {
    int64_t b;
    std::memcpy(&b, &v, sizeof(b));
    return b;
  }
  void value(const c10::IValue& v);  // a non-tensor value (or a list element)
  void tensor(const at::Tensor& t);

  Words words_;
};

}  // namespace hypershard::runtime
