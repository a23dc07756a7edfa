#include "layout/placements.h"

#include <algorithm>
#include <cctype>

#include "layout/error.h"

namespace hypershard::layout {
namespace {

// A name as the lexer reads it back: in double quotes, or in single quotes when it holds a
// double quote (Mesh::create rejects names holding both).
std::string quoted(const std::string& name) {
  const char quote = name.find('"') == std::string::npos ? '"' : '\'';
  return quote + name + quote;
}

// Whether the lexer reads `name` as one bare word (partial(...) prints such names unquoted).
bool is_bare_word(const std::string& name) {
  return !name.empty() && std::all_of(name.begin(), name.end(),
                                      [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

std::string dim_alias_string(const std::vector<std::string>& names) {
  if (names.empty()) return quoted("None");
  if (names.size() == 1) return quoted(names[0]);
  std::string out = "(";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + quoted(names[i]);
  return out + ")";
}

int64_t normalize_dim(int64_t dim, int64_t ndim, const std::string& context, const std::string& what) {
  HS_CHECK(dim >= -ndim && dim < ndim, context, what, " names dim ", dim, " of a ", ndim, "-d tensor; allowed: ",
           (ndim == 0 ? std::string("none (a 0-d tensor cannot be sharded)") : str_cat(-ndim, "..", ndim - 1)));
  return dim < 0 ? dim + ndim : dim;
}

// Tokens of the alias notation: punctuation, quoted names and bare words.
class AliasLexer {
 public:
  explicit AliasLexer(const std::string& text) : text_(text) {}

  bool at_end() {
    skip_space();
    return pos_ >= text_.size();
  }
  // Next token without consuming it; "" at the end.
  std::string peek() {
    size_t saved = pos_;
    std::string token = next();
    pos_ = saved;
    return token;
  }
  std::string next() {
    skip_space();
    if (pos_ >= text_.size()) return "";
    const char c = text_[pos_];
    if (c == '(' || c == ')' || c == ',' || c == ':' || c == ';') {
      ++pos_;
      return std::string(1, c);
    }
    if (c == '"' || c == '\'') {
      const size_t end = text_.find(c, pos_ + 1);
      if (end == std::string::npos) error("unterminated quoted name");
      std::string token = text_.substr(pos_, end - pos_ + 1);
      pos_ = end + 1;
      return token;
    }
    const size_t start = pos_;
    while (pos_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_')) ++pos_;
    if (pos_ == start) error(str_cat("unexpected character '", c, "'"));
    return text_.substr(start, pos_ - start);
  }
  void expect(const std::string& token) {
    const std::string got = next();
    if (got != token) error(str_cat("expected '", token, "' but found '", got, "'"));
  }
  [[noreturn]] void error(const std::string& problem) const {
    fail("alias layout", str_cat(problem, " at position ", pos_, " of '", text_,
                                 "'; allowed: a tuple such as (\"dp\", (\"tp\", \"sp\"), \"None\") "
                                 "optionally followed by partial(sum: tp)"));
  }

 private:
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  const std::string& text_;
  size_t pos_ = 0;
};

bool is_quoted(const std::string& token) { return token.size() >= 2 && (token[0] == '"' || token[0] == '\''); }

std::string unquote(AliasLexer& lexer, const std::string& token) {
  if (!is_quoted(token)) lexer.error(str_cat("expected a quoted axis name but found '", token, "'"));
  std::string name = token.substr(1, token.size() - 2);
  if (name.empty()) lexer.error("empty axis name");
  return name;
}

// One tuple item: None / "None" / "name" / ("a", "b", ...).
std::vector<std::string> parse_dim(AliasLexer& lexer) {
  const std::string token = lexer.next();
  if (token == "None") return {};
  if (token == "(") {
    std::vector<std::string> names;
    while (lexer.peek() != ")") {
      std::string name = unquote(lexer, lexer.next());
      if (name == "None") lexer.error("\"None\" cannot appear inside a multi-axis tuple");
      names.push_back(std::move(name));
      if (lexer.peek() == ",")
        lexer.next();
      else if (lexer.peek() != ")")
        lexer.error(str_cat("expected ',' or ')' but found '", lexer.peek(), "'"));
    }
    lexer.next();
    if (names.empty()) lexer.error("an empty tuple is not a dim; use \"None\" for an unsplit dim");
    return names;
  }
  std::string name = unquote(lexer, token);
  if (name == "None") return {};
  return {name};
}

}  // namespace

// ---------------------------------------------------------------- torch-style placements

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::Replicate:
      return "Replicate()";
    case Kind::Shard:
      return str_cat("Shard(", dim, ")");
    case Kind::Partial:
      return str_cat("Partial(", reduce_op_name(op), ")");
  }
  return "?";
}

std::string Placements::to_string() const {
  std::string out = "(";
  for (size_t i = 0; i < per_axis.size(); ++i) out += (i ? ", " : "") + per_axis[i].to_string();
  out += per_axis.size() == 1 ? ",)" : ")";
  if (!shard_order.empty()) {
    out += " order{";
    for (size_t i = 0; i < shard_order.size(); ++i) {
      out += str_cat(i ? ", " : "", shard_order[i].first, ": [");
      for (size_t j = 0; j < shard_order[i].second.size(); ++j) out += str_cat(j ? ", " : "", shard_order[i].second[j]);
      out += "]";
    }
    out += "}";
  }
  return out;
}

Layout from_placements(MeshPtr mesh, std::vector<int64_t> global_shape, const Placements& placements) {
  const std::string context = "placements";
  HS_CHECK(mesh != nullptr, context, "no mesh given");
  const int64_t ndim = static_cast<int64_t>(global_shape.size());
  HS_CHECK(static_cast<int64_t>(placements.per_axis.size()) == mesh->ndim(), context, placements.per_axis.size(),
           " placements given for mesh ", mesh->to_string(), " with ", mesh->ndim(),
           " axes; allowed: one placement per mesh axis");
  DimAxes dim_axes(ndim);
  PartialOps partial(mesh->ndim());
  for (int64_t axis = 0; axis < mesh->ndim(); ++axis) {
    const Placement& p = placements.per_axis[axis];
    if (p.kind == Placement::Kind::Shard) {
      const int64_t dim =
          normalize_dim(p.dim, ndim, context, str_cat("Shard on mesh axis '", mesh->axis_names()[axis], "'"));
      dim_axes[dim].push_back(axis);  // ascending mesh-axis order by default
    } else if (p.kind == Placement::Kind::Partial) {
      partial[axis] = p.op;
    }
  }
  std::vector<bool> ordered(ndim, false);
  for (const auto& [raw_dim, axes] : placements.shard_order) {
    const int64_t dim = normalize_dim(raw_dim, ndim, context, "shard order");
    HS_CHECK(!ordered[dim], context, "shard order lists dim ", dim, " twice");
    ordered[dim] = true;
    std::vector<int64_t> sorted = axes;
    std::sort(sorted.begin(), sorted.end());
    HS_CHECK(
        sorted == dim_axes[dim], context, "shard order for dim ", dim, " must list exactly the mesh axes with Shard(",
        dim, ") (",
        [&] {
          std::string s;
          for (size_t i = 0; i < dim_axes[dim].size(); ++i) s += (i ? ", " : "") + mesh->axis_names()[dim_axes[dim][i]];
          return s.empty() ? std::string("none") : s;
        }(),
        ")");
    dim_axes[dim] = axes;
  }
  return Layout::create(std::move(mesh), std::move(global_shape), std::move(dim_axes), std::move(partial));
}

Placements to_placements(const Layout& layout) {
  Placements out;
  out.per_axis.resize(layout.mesh()->ndim());
  for (int64_t axis = 0; axis < layout.mesh()->ndim(); ++axis)
    if (layout.partial()[axis]) out.per_axis[axis] = Placement::partial(*layout.partial()[axis]);
  for (int64_t dim = 0; dim < layout.ndim(); ++dim) {
    const auto& axes = layout.dim_axes()[dim];
    for (int64_t axis : axes) out.per_axis[axis] = Placement::shard(dim);
    if (!std::is_sorted(axes.begin(), axes.end())) out.shard_order.emplace_back(dim, axes);
  }
  return out;
}

// ---------------------------------------------------------------- alias notation

std::string AliasLayout::to_string() const {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + dim_alias_string(dims[i]);
  out += dims.size() == 1 ? ",)" : ")";
  if (partial.empty()) return out;
  // Group axis names by op, ops in enum order, so the text is canonical.
  std::string groups;
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod}) {
    std::string names;
    for (const auto& [name, axis_op] : partial)
      if (axis_op == op) names += (names.empty() ? "" : ", ") + (is_bare_word(name) ? name : quoted(name));
    if (!names.empty()) groups += str_cat(groups.empty() ? "" : "; ", reduce_op_name(op), ": ", names);
  }
  return out + " partial(" + groups + ")";
}

AliasLayout parse_alias(const std::string& text) {
  AliasLexer lexer(text);
  AliasLayout alias;
  lexer.expect("(");
  while (lexer.peek() != ")") {
    if (lexer.peek().empty()) lexer.error("missing ')'");
    alias.dims.push_back(parse_dim(lexer));
    if (lexer.peek() == ",")
      lexer.next();
    else if (lexer.peek().empty())
      lexer.error("missing ')'");
    else if (lexer.peek() != ")")
      lexer.error(str_cat("expected ',' or ')' but found '", lexer.peek(), "'"));
  }
  lexer.next();
  if (!lexer.at_end()) {
    lexer.expect("partial");
    lexer.expect("(");
    while (true) {
      const ReduceOp op = parse_reduce_op(lexer.next());
      lexer.expect(":");
      while (true) {
        const std::string name = lexer.next();
        if (name.empty() || name == ")" || name == "," || name == ";" || name == ":")
          lexer.error("expected an axis name in partial(...)");
        const std::string bare = is_quoted(name) ? unquote(lexer, name) : name;
        if (!alias.partial.emplace(bare, op).second) lexer.error(str_cat("axis '", bare, "' is Partial twice"));
        if (lexer.peek() != ",") break;
        lexer.next();
      }
      if (lexer.peek() != ";") break;
      lexer.next();
    }
    lexer.expect(")");
    if (!lexer.at_end()) lexer.error(str_cat("unexpected '", lexer.peek(), "' after partial(...)"));
  }
  return alias;
}

Layout from_alias(MeshPtr mesh, std::vector<int64_t> global_shape, const AliasLayout& alias) {
  const std::string context = "alias layout";
  HS_CHECK(mesh != nullptr, context, "no mesh given");
  HS_CHECK(alias.dims.size() == global_shape.size(), context, alias.to_string(), " names ", alias.dims.size(),
           " dims but the tensor ", shape_string(global_shape), " has ", global_shape.size(),
           "; allowed: one entry per tensor dim");
  DimAxes dim_axes(global_shape.size());
  for (size_t d = 0; d < alias.dims.size(); ++d)
    for (const auto& name : alias.dims[d]) dim_axes[d].push_back(mesh->axis_index(name));
  PartialOps partial(mesh->ndim());
  for (const auto& [name, op] : alias.partial) partial[mesh->axis_index(name)] = op;
  return Layout::create(std::move(mesh), std::move(global_shape), std::move(dim_axes), std::move(partial));
}

AliasLayout to_alias(const Layout& layout) {
  AliasLayout alias;
  const auto& names = layout.mesh()->axis_names();
  for (const auto& axes : layout.dim_axes()) {
    std::vector<std::string> dim;
    for (int64_t axis : axes) dim.push_back(names[axis]);
    alias.dims.push_back(std::move(dim));
  }
  for (size_t axis = 0; axis < layout.partial().size(); ++axis)
    if (layout.partial()[axis]) alias.partial.emplace(names[axis], *layout.partial()[axis]);
  return alias;
}

// ---------------------------------------------------------------- tensor_map

Layout from_tensor_map(MeshPtr mesh, std::vector<int64_t> global_shape, const TensorMap& map,
                       const PartialOps& partial) {
  const std::string context = "tensor_map";
  HS_CHECK(mesh != nullptr, context, "no mesh given");
  const int64_t mesh_ndim = mesh->ndim();
  HS_CHECK(map.size() == global_shape.size(), context, "tensor_map has ", map.size(), " entries but the tensor ",
           shape_string(global_shape), " has ", global_shape.size(), " dims; allowed: one entry per tensor dim");
  DimAxes dim_axes(global_shape.size());
  for (size_t d = 0; d < map.size(); ++d) {
    HS_CHECK(!map[d].empty(), context, "entry for dim ", d, " is empty; allowed: -1 or mesh axes 0..", mesh_ndim - 1,
             " counted from the right");
    if (map[d].size() == 1 && map[d][0] == -1) continue;
    for (int64_t v : map[d]) {
      HS_CHECK(v >= 0 && v < mesh_ndim, context, "entry ", v, " for dim ", d,
               " is out of range; allowed: -1 alone, or mesh axes 0..", mesh_ndim - 1, " counted from the right");
      dim_axes[d].push_back(mesh_ndim - 1 - v);
    }
  }
  return Layout::create(std::move(mesh), std::move(global_shape), std::move(dim_axes), partial);
}

TensorMap to_tensor_map(const Layout& layout) {
  const int64_t mesh_ndim = layout.mesh()->ndim();
  TensorMap map;
  for (const auto& axes : layout.dim_axes()) {
    if (axes.empty()) {
      map.push_back({-1});
      continue;
    }
    std::vector<int64_t> entry;
    for (int64_t axis : axes) entry.push_back(mesh_ndim - 1 - axis);
    map.push_back(std::move(entry));
  }
  return map;
}

}  // namespace hypershard::layout
