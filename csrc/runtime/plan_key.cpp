#include "runtime/plan_key.h"

#include "runtime/dtensor_impl.h"

namespace hypershard::runtime {

void PlanKey::tensor(const at::Tensor& t) {
  if (!t.defined()) {
    undefined_tensor();
  } else if (const auto* impl = dtensor_impl(t)) {
    dtensor(impl->layout().get(), t.scalar_type());
  } else {
    plain_tensor(t.scalar_type(), t.sizes());
  }
}

void PlanKey::value(const c10::IValue& v) {
  if (v.isNone()) {
    none();
  } else if (v.isTensor()) {
    tensor(v.toTensor());
  } else if (v.isBool()) {
    boolean(v.toBool());
  } else if (v.isInt()) {
    integer(v.toInt());
  } else if (v.isSymInt()) {
    if (auto concrete = v.toSymInt().maybe_as_int())
      integer(*concrete);
    else
      opaque("SymInt");  // symbolic: no eager rule sees one
  } else if (v.isDouble()) {
    real(v.toDouble());
  } else if (v.isComplexDouble()) {
    complex(v.toComplexDouble());
  } else if (v.isString()) {
    string(v.toStringRef());
  } else if (v.isDevice()) {
    device(v.toDevice());
  } else if (v.isList() || v.isTuple()) {
    const c10::ArrayRef<c10::IValue> elements = v.isList() ? v.toListRef() : v.toTupleRef().elements().asArrayRef();
    list(elements.size());
    for (const auto& element : elements) value(element);
  } else {
    opaque(v.tagKind());
  }
}

void PlanKey::argument(const c10::IValue& v, bool tensor_typed, bool key_scalars) {
  if (tensor_typed || key_scalars || v.isTensor() || v.isTensorList()) value(v);
}

}  // namespace hypershard::runtime
